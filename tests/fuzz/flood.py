"""Idle-connection flood against a running wick on loopback: opens N idle TCP connections,
then times 20 `/health` requests and counts how many flood sockets the server closed
(the connection cap evicts the longest-idle one for a newcomer).

    wick serve --port 8080 &
    python3 tests/fuzz/flood.py 8080 15000

Bounded: N connections, 20 requests, loopback only.
"""
import resource
import socket
import sys
import time

import httpx


def main() -> None:
    port, n = int(sys.argv[1]), int(sys.argv[2])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, n + 1024), hard))
    started = time.monotonic()
    flood, failed = [], 0
    for _ in range(n):
        try:
            flood.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except OSError:
            failed += 1
    opened = time.monotonic() - started
    latencies = []
    for _ in range(20):
        t = time.monotonic()
        r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
        latencies.append(time.monotonic() - t)
        assert r.status_code == 200, r.status_code
    closed = 0
    for c in flood:
        c.setblocking(False)
        try:
            if c.recv(1) == b"":
                closed += 1
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
    latencies.sort()
    print(f"opened {len(flood)} (failed {failed}) in {opened:.2f}s; /health x20: "
          f"median {latencies[10] * 1e3:.0f} ms, max {latencies[-1] * 1e3:.0f} ms; "
          f"server closed {closed} idle sockets")


if __name__ == "__main__":
    main()
