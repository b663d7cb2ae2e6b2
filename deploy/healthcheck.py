"""The images' HEALTHCHECK: asks the component's own liveness probe (`/healthz` on its
metrics port, see producers/metrics.py) and exits 0 when it answers 200, else 1 with the
reason in one line. The port is `$LAGSCOPE_HEALTH_PORT` (the worker image sets 9464, the
sidecar image 9465, as the manifests and compose start them with `--metrics-port`).

    python -m lagscope.deploy.healthcheck            # in the container
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

#: The environment variable naming the port (not a `LAGSCOPE_<SECTION>__<FIELD>` setting:
#: no command reads it).
PORT_ENV = "LAGSCOPE_HEALTH_PORT"


def check(port: int, timeout_s: float = 5.0) -> tuple[bool, str]:
    """Whether http://127.0.0.1:PORT/healthz answers 200, and its line."""
    url = f"http://127.0.0.1:{port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as answer:
            return True, answer.read().decode(errors="replace").strip()
    except urllib.error.HTTPError as exc:
        return False, exc.read().decode(errors="replace").strip() or f"HTTP {exc.code}"
    except OSError as exc:
        reason = getattr(exc, "reason", None) or exc
        return False, f"{url}: {reason} (is the command started with --metrics-port {port}?)"


def main() -> int:
    port = int(os.environ.get(PORT_ENV, "9464"))
    healthy, line = check(port)
    print(line, file=sys.stdout if healthy else sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
