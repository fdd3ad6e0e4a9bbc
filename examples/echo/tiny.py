"""The smallest HTTP/1.1 app the edge proxy's benchmark starts: `socket` and `threading` only, run with `-S`.

`app.py` spends most of its start importing asyncio and friends (30 to 140 ms here, more than the platform's
own part of an autostart); this one is listening a few milliseconds after its interpreter starts, so
`fauxmad bench proxy` can time what the proxy, the bus and the worker add to a start, the way a machine with a
compiled server would see it. Every GET (any path, keep-alive) answers 200 with the machine's id; anything it
cannot read closes the connection.
"""

import os
import socket
import threading

MACHINE = os.environ.get("FAUXMAD_MACHINE_ID", "local")
BODY = f'{{"machine": "{MACHINE}"}}'.encode()
ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\nx-machine: %s\r\n\r\n%s" % (
    len(BODY),
    MACHINE.encode(),
    BODY,
)


def serve(conn: socket.socket) -> None:
    pending = b""
    with conn:
        while True:
            while b"\r\n\r\n" not in pending:
                data = conn.recv(65536)
                if not data:
                    return
                pending += data
            head, _, pending = pending.partition(b"\r\n\r\n")
            if b"content-length:" in head.lower() or b"transfer-encoding:" in head.lower():
                return  # no bodies here: GETs only
            conn.sendall(ANSWER)
            if b"connection: close" in head.lower():
                return


def main() -> None:
    listener = socket.create_server(("127.0.0.1", int(os.environ.get("PORT", "8000"))), backlog=1024)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    main()
