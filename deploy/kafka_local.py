"""A real single-node Kafka (KRaft) for machines without Docker: tests, demos, laptops.

    python -m lagscope.deploy.kafka_local start --port 9092 --data-dir /tmp/lagscope-kafka
    python -m lagscope.deploy.kafka_local stop --data-dir /tmp/lagscope-kafka
    python -m lagscope.deploy.kafka_local fetch        # just download into the cache

Apache Kafka's broker is the `org.apache.kafka:kafka_2.13` artifact on Maven Central. We
resolve it and its runtime dependencies with Maven (`dependency:copy-dependencies` on a
generated pom) into a cache directory (`$LAGSCOPE_CACHE_DIR/kafka/<version>/`, by default
`~/.cache/lagscope/kafka/<version>/`, so an installed package never writes into its own
folder), then
run the KRaft storage formatter and `kafka.Kafka` with `java -cp`. Needs Java 17+ and
Maven on PATH (for the first fetch only). The broker listens on 127.0.0.1 only and runs
as combined broker+controller with a small heap.
"""

from __future__ import annotations

import argparse
import base64
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

KAFKA_VERSION = "3.9.1"
SLF4J_VERSION = "1.7.36"
DEFAULT_CACHE = (
    Path(
        os.environ.get("LAGSCOPE_CACHE_DIR")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lagscope"
    )
    / "kafka"
)
DEFAULT_HEAP = "512m"

_POM = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>lagscope.local</groupId>
  <artifactId>kafka-runtime</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.kafka</groupId>
      <artifactId>kafka_2.13</artifactId>
      <version>{kafka}</version>
    </dependency>
    <dependency>
      <groupId>org.slf4j</groupId>
      <artifactId>slf4j-reload4j</artifactId>
      <version>{slf4j}</version>
    </dependency>
  </dependencies>
</project>
"""

_LOG4J = """log4j.rootLogger=INFO, file
log4j.appender.file=org.apache.log4j.RollingFileAppender
log4j.appender.file.File={log}
log4j.appender.file.MaxFileSize=20MB
log4j.appender.file.MaxBackupIndex=1
log4j.appender.file.layout=org.apache.log4j.PatternLayout
log4j.appender.file.layout.ConversionPattern=[%d] %p %m (%c)%n
log4j.logger.kafka=INFO
log4j.logger.org.apache.kafka=INFO
"""


class KafkaLocalError(RuntimeError):
    """The local broker could not be fetched, formatted or started (the message says why)."""


def fetch_kafka(cache_dir: Path = DEFAULT_CACHE, version: str = KAFKA_VERSION) -> Path:
    """The directory of Kafka's runtime jars, downloading them on first use."""
    target = cache_dir / version
    libs = target / "libs"
    marker = target / ".complete"
    if marker.exists():
        return libs
    for tool in ("java", "mvn"):
        if shutil.which(tool) is None:
            raise KafkaLocalError(f"fetching Kafka {version} needs {tool!r} on PATH")
    target.mkdir(parents=True, exist_ok=True)
    (target / "pom.xml").write_text(_POM.format(kafka=version, slf4j=SLF4J_VERSION))
    result = subprocess.run(
        [
            "mvn", "-q", "-B", "-f", str(target / "pom.xml"),
            "dependency:copy-dependencies", f"-DoutputDirectory={libs}",
            "-DincludeScope=runtime",
        ],
        capture_output=True,
        text=True,
        check=False,
    )  # fmt: skip
    if result.returncode != 0 or not any(libs.glob("kafka_2.13-*.jar")):
        raise KafkaLocalError(
            f"mvn could not fetch org.apache.kafka:kafka_2.13:{version} into {libs} "
            f"(exit {result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    marker.write_text(version)
    return libs


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


class KafkaBroker:
    """One KRaft broker+controller process on 127.0.0.1 with its data in `data_dir`."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        port: int | None = None,
        controller_port: int | None = None,
        heap: str = DEFAULT_HEAP,
        cache_dir: Path = DEFAULT_CACHE,
        version: str = KAFKA_VERSION,
        initial_rebalance_delay_ms: int = 0,
        scram_users: dict[str, str] | None = None,
    ) -> None:
        """`initial_rebalance_delay_ms`: how long a new consumer group waits for more
        members before its first assignment (Kafka's default is 3000; 0 makes tests with
        one consumer fast, several workers meant to start together need the wait).

        `scram_users` (name -> password): also listen on SASL_SSL (`secure_port`), SCRAM-
        SHA-512 over TLS. The users are created by Kafka's own storage formatter, and the
        broker's certificate is signed by a CA made for this broker (`ca_file`, what a
        client trusts), both with openssl, in PEM as the broker reads it."""
        self.data_dir = Path(data_dir).resolve()
        self.scram_users = dict(scram_users or {})
        self.secure_port = free_port() if self.scram_users else None
        self.initial_rebalance_delay_ms = initial_rebalance_delay_ms
        self.port = port or free_port()
        self.controller_port = controller_port or free_port()
        self.heap = heap
        self.cache_dir = cache_dir
        self.version = version
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def secure_bootstrap(self) -> str:
        """The SASL_SSL listener (only with `scram_users`)."""
        if self.secure_port is None:
            raise KafkaLocalError("this broker was started without a SASL_SSL listener")
        return f"127.0.0.1:{self.secure_port}"

    @property
    def ca_file(self) -> Path:
        """The PEM certificate of the CA that signed the broker's certificate."""
        return self.data_dir / "tls" / "ca.pem"

    def _make_certificates(self) -> Path:
        """A CA and a broker certificate for 127.0.0.1 signed by it; returns the broker's
        PEM key store (certificate chain, then its unencrypted PKCS#8 key)."""
        tls = self.data_dir / "tls"
        keystore = tls / "broker-keystore.pem"
        if keystore.exists():
            return keystore
        tls.mkdir(parents=True, exist_ok=True)
        (tls / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        commands = [
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "30",
             "-subj", "/CN=lagscope-test-ca", "-keyout", "ca-key.pem", "-out", "ca.pem"],
            ["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
             "-keyout", "broker-key.pem", "-out", "broker.csr"],
            ["openssl", "x509", "-req", "-in", "broker.csr", "-CA", "ca.pem", "-CAkey",
             "ca-key.pem", "-CAcreateserial", "-days", "30", "-extfile", "san.ext",
             "-out", "broker.pem"],
            ["openssl", "pkcs8", "-topk8", "-nocrypt", "-in", "broker-key.pem",
             "-out", "broker-key.pk8.pem"],
        ]  # fmt: skip
        if shutil.which("openssl") is None:
            raise KafkaLocalError(
                "a SASL_SSL listener needs 'openssl' on PATH for its certificates"
            )
        for command in commands:
            done = subprocess.run(command, cwd=tls, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise KafkaLocalError(
                    f"{' '.join(command[:2])} failed making the test certificates in {tls}: "
                    f"{done.stderr[-1000:]}"
                )
        keystore.write_text(
            (tls / "broker.pem").read_text()
            + (tls / "ca.pem").read_text()
            + (tls / "broker-key.pk8.pem").read_text()
        )
        return keystore

    def _secure_config(self) -> list[str]:
        if not self.scram_users:
            return []
        keystore = self._make_certificates()
        return [
            "sasl.enabled.mechanisms=SCRAM-SHA-512",
            "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config="
            "org.apache.kafka.common.security.scram.ScramLoginModule required;",
            "ssl.keystore.type=PEM",
            f"ssl.keystore.location={keystore}",
            "ssl.truststore.type=PEM",
            f"ssl.truststore.location={self.ca_file}",
        ]

    @property
    def pid_file(self) -> Path:
        return self.data_dir / "broker.pid"

    def _java(self, libs: Path, main: str, *args: str) -> list[str]:
        return [
            "java", f"-Xmx{self.heap}", "-Xms64m", "-XX:+UseSerialGC",
            "-Djava.awt.headless=true",
            f"-Dlog4j.configuration=file:{self.data_dir / 'log4j.properties'}",
            "-cp", f"{libs}/*", main, *args,
        ]  # fmt: skip

    def _write_config(self) -> Path:
        logs = self.data_dir / "kraft-logs"
        config = self.data_dir / "server.properties"
        secure = f",SASL_SSL://127.0.0.1:{self.secure_port}" if self.scram_users else ""
        config.write_text(
            "\n".join(
                [
                    "process.roles=broker,controller",
                    "node.id=1",
                    f"controller.quorum.voters=1@127.0.0.1:{self.controller_port}",
                    f"listeners=PLAINTEXT://127.0.0.1:{self.port},"
                    f"CONTROLLER://127.0.0.1:{self.controller_port}{secure}",
                    f"advertised.listeners=PLAINTEXT://127.0.0.1:{self.port}{secure}",
                    "controller.listener.names=CONTROLLER",
                    "inter.broker.listener.name=PLAINTEXT",
                    "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT"
                    + (",SASL_SSL:SASL_SSL" if secure else ""),
                    *self._secure_config(),
                    f"log.dirs={logs}",
                    "num.partitions=1",
                    "auto.create.topics.enable=true",
                    "offsets.topic.replication.factor=1",
                    "offsets.topic.num.partitions=4",
                    "transaction.state.log.replication.factor=1",
                    "transaction.state.log.min.isr=1",
                    f"group.initial.rebalance.delay.ms={self.initial_rebalance_delay_ms}",
                    "log.cleaner.dedupe.buffer.size=8388608",
                    "num.network.threads=2",
                    "num.io.threads=2",
                    "",
                ]
            )
        )
        (self.data_dir / "log4j.properties").write_text(
            _LOG4J.format(log=self.data_dir / "server.log")
        )
        return config

    def start(self, timeout_s: float = 90.0, attempts: int = 2) -> KafkaBroker:
        """Format storage on first start, launch, and wait until the broker answers.

        A JVM that fails to come up on a loaded machine is retried once (a first start on
        freshly formatted storage); if that fails too, the error names both failures.
        What a failed first start formatted is removed before the retry, nothing else:
        the directory may hold the user's own files, and the logs the error names stay.
        """
        storage = self.data_dir / "kraft-logs"
        fresh = not (storage / "meta.properties").exists()
        failures: list[str] = []
        for _ in range(attempts):
            try:
                return self._start_once(timeout_s)
            except KafkaLocalError as exc:
                failures.append(str(exc))
                if fresh:  # never wipe a broker's existing data (a restart keeps topics)
                    shutil.rmtree(storage, ignore_errors=True)
        raise KafkaLocalError(" / then: ".join(failures))

    def _start_once(self, timeout_s: float) -> KafkaBroker:
        libs = fetch_kafka(self.cache_dir, self.version)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self._write_config()
        if not (self.data_dir / "kraft-logs" / "meta.properties").exists():
            cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
            result = subprocess.run(
                self._java(libs, "kafka.tools.StorageTool", "format", "-t", cluster_id,
                           "-c", str(config), *self._scram_arguments()),
                capture_output=True,
                text=True,
                check=False,
            )  # fmt: skip
            if result.returncode != 0:
                raise KafkaLocalError(
                    f"formatting Kafka storage in {self.data_dir} failed "
                    f"(exit {result.returncode}): {result.stdout[-2000:]} {result.stderr[-2000:]}"
                )
        out = open(self.data_dir / "broker.out", "ab")  # noqa: SIM115 - owned by the process
        self.process = subprocess.Popen(
            self._java(libs, "kafka.Kafka", str(config)),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        out.close()
        self.pid_file.write_text(str(self.process.pid))
        self._wait_ready(timeout_s)
        return self

    def _scram_arguments(self) -> list[str]:
        """The formatter's `--add-scram` per user: credentials exist before the broker
        first starts, with no admin round trip."""
        arguments = []
        for name, password in self.scram_users.items():
            arguments += ["--add-scram", f"SCRAM-SHA-512=[name={name},password={password}]"]
        return arguments

    def _wait_ready(self, timeout_s: float) -> None:
        from confluent_kafka.admin import AdminClient

        deadline = time.monotonic() + timeout_s
        assert self.process is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise KafkaLocalError(
                    f"Kafka exited with code {self.process.returncode} during start; "
                    f"see {self.data_dir / 'server.log'} and {self.data_dir / 'broker.out'}:\n"
                    + _tail(self.data_dir / "broker.out")
                )
            if _port_open(self.port):
                try:
                    admin = AdminClient({"bootstrap.servers": self.bootstrap})
                    metadata = admin.list_topics(timeout=5)
                    if metadata.brokers:
                        return
                except Exception:  # not ready yet; retried until the deadline
                    pass
            time.sleep(0.3)
        self.stop()
        raise KafkaLocalError(
            f"Kafka on {self.bootstrap} did not answer within {timeout_s:.0f}s; see "
            f"{self.data_dir / 'server.log'}:\n" + _tail(self.data_dir / "server.log")
        )

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop gracefully (SIGTERM), then forcefully if it does not exit in time."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        self.pid_file.unlink(missing_ok=True)

    def kill(self) -> None:
        """kill -9: a crashed broker (fault tests)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None

    def __enter__(self) -> KafkaBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _tail(path: Path, limit: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except FileNotFoundError:
        return f"({path} does not exist)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kafka-local", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("fetch", help="download Kafka into the cache")
    start = sub.add_parser("start", help="start a broker and wait until it answers")
    start.add_argument("--port", type=int, default=9092)
    start.add_argument("--controller-port", type=int, default=None)
    start.add_argument("--data-dir", default="/tmp/lagscope-kafka")
    start.add_argument("--heap", default=DEFAULT_HEAP)
    start.add_argument("--foreground", action="store_true", help="run until interrupted")
    start.add_argument(
        "--initial-rebalance-delay-ms",
        type=int,
        default=0,
        help="a new consumer group's wait for more members (several workers started together)",
    )
    stop = sub.add_parser("stop", help="stop the broker started with --data-dir")
    stop.add_argument("--data-dir", default="/tmp/lagscope-kafka")
    args = parser.parse_args(argv)
    try:
        if args.action == "fetch":
            print(fetch_kafka())
            return 0
        if args.action == "start":
            broker = KafkaBroker(
                args.data_dir, port=args.port, controller_port=args.controller_port,
                heap=args.heap, initial_rebalance_delay_ms=args.initial_rebalance_delay_ms,
            )  # fmt: skip
            broker.start()
            print(f"Kafka {KAFKA_VERSION} up on {broker.bootstrap} (pid {broker.process.pid})")
            if args.foreground:
                try:
                    broker.process.wait()
                except KeyboardInterrupt:
                    broker.stop()
            return 0
        pid_file = Path(args.data_dir) / "broker.pid"
        if not pid_file.exists():
            print(f"no broker running for {args.data_dir}", file=sys.stderr)
            return 1
        pid = int(pid_file.read_text())
        os.kill(pid, signal.SIGTERM)
        for _ in range(300):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        pid_file.unlink(missing_ok=True)
        return 0
    except KafkaLocalError as exc:
        print(f"kafka-local: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
