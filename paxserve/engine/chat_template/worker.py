"""`python -m paxserve.engine.chat_template.worker TIMEOUT_S MAX_OUTPUT_CHARS MEMORY_LIMIT_BYTES`:
one chat-template render process of `RenderPool`, reading requests on stdin and answering on stdout
(multiprocessing's pickled messages)."""

from __future__ import annotations

import os
import sys
from multiprocessing.connection import Connection

from paxserve.engine.chat_template.pool import serve
from paxserve.engine.chat_template.template import RenderLimits


def main() -> None:
    timeout_s, max_output_chars, memory_limit_bytes = sys.argv[1:4]
    send = Connection(os.dup(1), readable=False)
    recv = Connection(os.dup(0), writable=False)
    os.dup2(2, 1)  # anything printed goes to stderr, never into the replies
    serve(_Duplex(recv, send), RenderLimits(float(timeout_s), int(max_output_chars)), int(memory_limit_bytes))


class _Duplex:
    def __init__(self, recv: Connection, send: Connection) -> None:
        self.recv, self.send = recv.recv, send.send


if __name__ == "__main__":
    main()
