"""Real megatron-core jobs on CPU (gloo, 127.0.0.1) for the adapter's tests."""
