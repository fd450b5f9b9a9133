"""The gateway's HTTP client against real servers on 127.0.0.1 whose every byte the test writes (asyncio's own
server), so that each way an answer can be framed, cut or withheld is sent as it would be."""

from __future__ import annotations

import asyncio
import socket

import pytest

from agl_core.gateway.http_client import HIGH_WATER, HttpClient, UpstreamError


class RawServer:
    """A TCP server on 127.0.0.1 answering each connection with ``handler(reader, writer, server)``; it counts
    connections and keeps every request's head."""

    def __init__(self, handler):
        self.handler, self.connections, self.heads, self.closed = handler, 0, [], asyncio.Event()

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1/chat/completions"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer, self)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            self.closed.set()

    async def request(self, reader: asyncio.StreamReader) -> bytes:
        """Read one request (head and body); its body."""
        head = await reader.readuntil(b"\r\n\r\n")
        self.heads.append(head)
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        return await reader.readexactly(length)


def answer(body: bytes, *headers: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + b"".join(h + b"\r\n" for h in headers) \
        + b"Content-Length: %d\r\n\r\n" % len(body) + body


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def run(coroutine):
    return asyncio.run(coroutine)


def replying(reply: bytes, *, close: bool = False):
    """A handler that answers one request with ``reply``, then closes the connection (``close``) or waits for the
    client to leave."""
    async def handler(reader, writer, server):
        await server.request(reader)
        writer.write(reply)
        await writer.drain()
        if not close:
            await reader.read()
    return handler


def test_answers_come_back_whole_with_their_headers_and_kept_alive_connections_are_reused():
    async def echo(reader, writer, server):
        while True:
            body = await server.request(reader)
            writer.write(answer(b'{"echo": %s}' % body, b"X-Kind: echo"))

    async def main():
        async with RawServer(echo) as server:
            client = HttpClient(5.0, {"Authorization": "Bearer secret"})
            for n in range(3):
                async with await client.post(server.url, b'{"n": %d}' % n) as response:
                    assert (response.status, response.content_type, response.headers["x-kind"]) == \
                        (200, "application/json", "echo")
                    assert await response.read() == b'{"echo": {"n": %d}}' % n
            await client.close()
            return server

    server = run(main())
    assert server.connections == 1
    head = server.heads[0].decode()
    assert head.startswith("POST /v1/chat/completions HTTP/1.1\r\n") and "Authorization: Bearer secret\r\n" in head \
        and "Content-Type: application/json\r\n" in head


def test_a_chunked_answer_is_read_as_it_comes_not_when_it_ends():
    async def stream(reader, writer, server):
        await server.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n" + chunk(b"data: 1\n\n"))
        await server.go_on.wait()
        writer.write(chunk(b"data: 2\n\n") + b"0\r\n\r\n")
        await reader.read()

    async def main():
        async with RawServer(stream) as server:
            server.go_on = asyncio.Event()
            client = HttpClient(5.0)
            response = await client.post(server.url, b"{}")
            assert response.content_type == "text/event-stream"
            first = await response.readany()  # the second chunk waits for this read
            server.go_on.set()
            rest = await response.read()
            response.release()
            await client.close()
            return first, rest

    assert run(main()) == (b"data: 1\n\n", b"data: 2\n\n")


def test_an_answer_ended_by_the_server_closing_is_read_whole():
    async def close_delimited(reader, writer, server):
        await server.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\npart one, ")
        await writer.drain()
        writer.write(b"part two")

    async def main():
        async with RawServer(close_delimited) as server:
            client = HttpClient(5.0)
            async with await client.post(server.url, b"{}") as response:
                return await response.read()

    assert run(main()) == b"part one, part two"


def test_a_kept_alive_connection_the_server_closed_is_replaced_and_the_request_sent_again():
    async def one_answer_per_connection(reader, writer, server):  # keeps alive in words, closes in deeds
        body = await server.request(reader)
        writer.write(answer(body))
        await writer.drain()

    async def main():
        async with RawServer(one_answer_per_connection) as server:
            client = HttpClient(5.0)
            bodies = []
            for n in range(3):
                async with await client.post(server.url, b'{"n": %d}' % n) as response:
                    bodies.append(await response.read())
                await server.closed.wait()
                server.closed.clear()
            return server, bodies

    server, bodies = run(main())
    assert bodies == [b'{"n": 0}', b'{"n": 1}', b'{"n": 2}'] and server.connections == 3


def test_a_server_that_does_not_listen_is_an_upstream_error_naming_the_url():
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{free.getsockname()[1]}/v1/completions"

    async def main():
        await HttpClient(5.0).post(url, b"{}")

    with pytest.raises(UpstreamError, match="cannot connect to http://127.0.0.1:.*/v1/completions"):
        run(main())


def test_a_server_that_does_not_answer_in_time_is_a_timeout_and_its_connection_is_dropped():
    async def main():
        async with RawServer(replying(b"")) as server:
            with pytest.raises(TimeoutError):
                await HttpClient(0.2).post(server.url, b"{}")
            await asyncio.wait_for(server.closed.wait(), 5)

    run(main())


def test_a_deadline_covers_the_body_too():
    stalls_mid_stream = replying(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk(b"data: 1\n\n"))

    async def main():
        async with RawServer(stalls_mid_stream) as server:
            response = await HttpClient(0.3).post(server.url, b"{}")
            assert await response.readany() == b"data: 1\n\n"
            with pytest.raises(TimeoutError):
                await response.readany()

    run(main())


@pytest.mark.parametrize("reply, error", [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this", "closed the connection mid-answer"),
    (b"", "closed the connection before answering"),
    (b"SMTP ready\r\n\r\n", "not HTTP/1.1"),
])
def test_an_answer_cut_short_or_not_http_is_an_upstream_error_saying_so(reply, error):
    async def main():
        async with RawServer(replying(reply, close=True)) as server:
            async with await HttpClient(5.0).post(server.url, b"{}") as response:
                await response.read()

    with pytest.raises(UpstreamError, match=error):
        run(main())


def test_an_interim_100_continue_is_skipped_for_the_answer_that_follows():
    async def main():
        async with RawServer(replying(b"HTTP/1.1 100 Continue\r\n\r\n" + answer(b"{}"))) as server:
            async with await HttpClient(5.0).post(server.url, b"{}") as response:
                return response.status, await response.read()

    assert run(main()) == (200, b"{}")


def test_releasing_an_unfinished_stream_closes_its_connection_and_draining_a_finished_one_keeps_it():
    async def streams(reader, writer, server):
        while True:
            body = await server.request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk(b"data: [DONE]\n\n"))
            if body == b"unfinished":
                await reader.read()  # until the client leaves
                return
            await server.go_on.wait()
            server.go_on.clear()
            writer.write(b"0\r\n\r\n")  # the end of the framing after the last event, as Starlette sends it

    async def main():
        async with RawServer(streams) as server:
            server.go_on = asyncio.Event()
            client = HttpClient(5.0)
            for _ in range(2):  # the last event read, released with drain: the connection waits for its end
                response = await client.post(server.url, b"{}")
                assert await response.readany() == b"data: [DONE]\n\n"
                response.release(drain=True)
                server.go_on.set()
                await asyncio.wait_for(pooled(client, server), 5)
            response = await client.post(server.url, b"unfinished")  # released unfinished: the server sees it leave
            await response.readany()
            response.release()
            await asyncio.wait_for(server.closed.wait(), 5)
            return server.connections

    async def pooled(client, server):
        while not client._idle[("127.0.0.1", server.server.sockets[0].getsockname()[1], False)]:
            await asyncio.sleep(0.01)

    assert run(main()) == 1


def test_a_reader_slower_than_the_server_holds_at_most_about_the_high_water_mark():
    total = 8 * HIGH_WATER

    async def floods(reader, writer, server):
        await server.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
        block = b"x" * 2**16
        for _ in range(total // len(block)):
            writer.write(block)
            await writer.drain()

    async def main():
        async with RawServer(floods) as server:
            response = await HttpClient(5.0).post(server.url, b"{}")
            await asyncio.sleep(0.3)  # the server writes as fast as it can meanwhile
            held = response._connection._buffered
            received = len(await response.read())
            response.release()
            return held, received

    held, received = run(main())
    assert 0 < held <= HIGH_WATER + 2**18 and received == total
