"""A minimal HTTP/1.1 keep-alive client on asyncio streams, for bench_http's ``--client raw``.

On a 2-core machine an httpx client spends more CPU per request than the server it
measures, so the rates it drives are the client's. This one writes a request and reads
the status line, the headers and a Content-Length (or chunked) body, nothing more: the
server becomes what limits the rate. It is a measuring tool for our own loopback server,
not a general client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Answer:
    status_code: int
    headers: Mapping[str, str]
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


class RawConnection:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes, headers: Mapping[str, str]) -> Answer:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        lines = [f"POST {path} HTTP/1.1", f"Host: {self.host}", f"Content-Length: {len(body)}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionError(f"the server closed the connection before answering {path}")
        found: dict[str, str] = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            found[name.strip().lower()] = value.strip()
        if "content-length" in found:
            content = await self.reader.readexactly(int(found["content-length"]))
        elif found.get("transfer-encoding", "").lower() == "chunked":
            content = await self._chunked()
        else:
            raise ConnectionError(f"{path}: a response with no length (the bench sends none)")
        if found.get("connection", "").lower() == "close":
            await self.close()
        return Answer(int(status_line.split()[1]), found, content)

    async def _chunked(self) -> bytes:
        assert self.reader is not None
        parts = []
        while size := int((await self.reader.readline()).split(b";")[0], 16):
            parts.append(await self.reader.readexactly(size))
            await self.reader.readline()
        await self.reader.readline()  # the blank line after the last chunk
        return b"".join(parts)

    async def close(self) -> None:
        writer, self.writer, self.reader = self.writer, None, None
        if writer is not None:
            writer.close()
            await writer.wait_closed()
