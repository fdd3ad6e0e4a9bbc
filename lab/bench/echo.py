"""The bus's own request round trip, the yardstick for create latency.

The responder runs in another process (`python -c`, nats-py on uvloop, as the broker does) so the
round trip crosses the same boundaries a create does: client -> nats-server -> another process ->
nats-server -> client. The client side is the benchmark's own: a `bus.transport.connection` client sending
with `bus.transport.service.request`, the path `FleetClient.create` takes, on the same event loop.
"""

from __future__ import annotations

import selectors
import subprocess
import sys
import time
import uuid
from types import TracebackType

from bus.transport.connection import connect
from bus.transport.service import request
from lab.bench import BenchError
from lab.bench.stats import Latency, summarize

# Answers every request on argv[2] with its own payload; exits when its stdin closes (so when the
# benchmark ends, or dies).
RESPONDER = """
import asyncio, json, os, ssl, sys
import nats, uvloop

def secure():  # a secure fleet's credentials file (bus/transport/credentials.py), read as any nats-py service would
    path = os.environ.get("FAUXMAD_CREDS")
    if not path or not sys.argv[1].startswith("tls://"):
        return {}
    creds, base = json.load(open(path)), os.path.dirname(path)
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=os.path.join(base, creds["ca"]))
    context.load_cert_chain(os.path.join(base, creds["cert"]), os.path.join(base, creds["key"]))
    return {"tls": context, "nkeys_seed_str": creds["seed"], "inbox_prefix": creds["inbox_prefix"]}

async def main():
    nc = await nats.connect(sys.argv[1].split(","), name="fauxmad-bench-echo", **secure())
    async def echo(msg):
        await nc.publish(msg.reply, msg.data)
    await nc.subscribe(sys.argv[2], cb=echo)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await nc.close()

uvloop.run(main())
"""

PAYLOAD = b"x" * 200  # about the size of a small create request


class EchoResponder:
    """`with EchoResponder(url) as echo:` a responder process on a subject of its own (`echo.subject`)."""

    def __init__(self, url: str, *, ready_timeout: float = 20.0) -> None:
        self.url = url
        self.subject = f"fauxmad.bench.echo.{uuid.uuid4().hex[:12]}"
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> EchoResponder:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", RESPONDER, self.url, self.subject],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            ready = sel.select(self.ready_timeout) and self.proc.stdout.readline().strip() == b"ready"
        if not ready:
            err = self._close()
            raise BenchError(f"the echo responder did not start: {err or 'no answer within the timeout'}")
        return self

    def _close(self) -> str:
        proc, self.proc = self.proc, None
        if proc is None:
            return ""
        assert proc.stdin is not None and proc.stderr is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        lines = proc.stderr.read().decode(errors="replace").strip().splitlines()
        if proc.stdout is not None:
            proc.stdout.close()
        proc.stderr.close()
        return lines[-1] if lines else ""

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._close()

    async def measure(self, count: int = 500, warmup: int = 50) -> Latency:
        """`count` sequential requests (after `warmup` unmeasured ones), summarized."""
        nc = await connect(self.url, "fauxmad-bench-echo-client")
        try:
            samples = []
            for i in range(warmup + count):
                began = time.perf_counter()
                await request(nc, self.subject, PAYLOAD, timeout=5)
                if i >= warmup:
                    samples.append(time.perf_counter() - began)
        finally:
            await nc.close()
        return summarize(samples)
