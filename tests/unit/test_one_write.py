"""``OneWrite``: what a response writes in one turn of the event loop reaches the socket in
one write at the end of that turn (uvicorn writes a head and a body separately)."""

from __future__ import annotations

import asyncio

from kiln.api.server_limits import OneWrite


class Socket:
    """What reaches the connection, write by write (None: closed)."""

    def __init__(self) -> None:
        self.writes: list[bytes | None] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return bool(self.writes) and self.writes[-1] is None

    def close(self) -> None:
        self.writes.append(None)

    def get_extra_info(self, name: str) -> str:
        return f"extra {name}"


async def test_a_head_and_its_body_go_out_in_one_write() -> None:
    socket = Socket()
    one = OneWrite(socket, asyncio.get_running_loop())  # type: ignore[arg-type]
    one.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
    one.write(b"{}")
    assert socket.writes == []  # held until the turn ends
    await asyncio.sleep(0)
    assert socket.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"]


async def test_a_stream_sends_each_turns_writes_as_the_turn_ends() -> None:
    socket = Socket()
    one = OneWrite(socket, asyncio.get_running_loop())  # type: ignore[arg-type]
    one.write(b"head")
    await asyncio.sleep(0)
    one.write(b"event 1")
    one.write(b"event 2")
    await asyncio.sleep(0)
    assert socket.writes == [b"head", b"event 1event 2"]


async def test_close_sends_what_is_held_first_and_nothing_goes_after_it() -> None:
    socket = Socket()
    one = OneWrite(socket, asyncio.get_running_loop())  # type: ignore[arg-type]
    one.write(b"last words")
    one.close()
    await asyncio.sleep(0)
    assert socket.writes == [b"last words", None]
    assert one.is_closing()
    one.write(b"too late")
    await asyncio.sleep(0)
    assert socket.writes == [b"last words", None]
    assert one.get_extra_info("peername") == "extra peername"  # the rest is the socket's
