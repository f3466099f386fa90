"""The HTTP transport under the application: the listening socket, uvicorn's HTTP/1.1 protocol with our two
rules (malformed requests and slow requests answered with error objects), the body-size middleware, and the
writes of a stream (headers with its first events, one socket send per event-loop pass).

Nothing here knows the model or the routes (app.py); an error here is an OpenAI error object as everywhere.
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
from http import HTTPStatus

from fastapi.responses import JSONResponse, StreamingResponse

from ..errors import UserError
from .protocol import DONE, error_body

READ_TIMEOUT = 30.0  # seconds a request may take to arrive whole (http_protocol)


def error_json(status: int, message: str, type: str = "invalid_request_error", param=None, code=None) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status)



class BodyLimit:
    """ASGI middleware: 413 for a request body over `limit` bytes, by Content-Length or (chunked uploads) by
    reading it: the body is read here, at most limit + 1 bytes, then handed to the app. A body still arriving
    when the server begins to shut down (`closing` is set) is answered 503 at once: shutdown does not wait
    for bytes that may never come."""

    def __init__(self, app, limit: int, closing: asyncio.Event):
        self.app, self.limit, self.closing = app, limit, closing

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return await error_json(400, "bad Content-Length header")(scope, receive, send)
            if int(length) > self.limit:
                return await self._too_large(scope, receive, send)
        body, more = [], True
        size = 0
        while more:
            message = await self._receive(receive)
            if message is None:
                return await error_json(503, "the server is shutting down", "server_error",
                                        code="shutting_down")(scope, receive, send)
            if message["type"] != "http.request":  # the client left while sending
                return
            body.append(message.get("body", b""))
            size += len(body[-1])
            more = message.get("more_body", False)
            if size > self.limit:
                return await self._too_large(scope, receive, send)
        replay = [{"type": "http.request", "body": b"".join(body), "more_body": False}]

        async def replay_receive():
            return replay.pop() if replay else await receive()
        await self.app(scope, replay_receive, send)

    async def _receive(self, receive):
        """The next message of the request, or None once the server is shutting down."""
        if self.closing.is_set():
            return None
        get, stop = asyncio.ensure_future(receive()), asyncio.ensure_future(self.closing.wait())
        try:
            await asyncio.wait((get, stop), return_when=asyncio.FIRST_COMPLETED)
        finally:
            get.cancel(), stop.cancel()
        return get.result() if get.done() and not get.cancelled() else None

    async def _too_large(self, scope, receive, send):
        await error_json(413, f"request body larger than {self.limit} bytes", code="body_too_large")(scope, receive, send)



class EventStream(StreamingResponse):
    """A server-sent-events reply whose status line and headers leave with its first events when these come
    within HEADERS_WAIT seconds (a stream's first token, after its prompt): one socket write and one wake
    of the client, not two during the prompt's forward pass. A request that waits longer (for a free row,
    or a long prompt) gets its headers at HEADERS_WAIT, so its client knows it was taken. The chunk that
    ends with [DONE] ends the reply too (one message less through the middleware)."""

    HEADERS_WAIT = 0.05

    async def stream_response(self, send) -> None:
        chunks = aiter(self.body_iterator)
        first = asyncio.ensure_future(anext(chunks, None))
        try:
            await asyncio.wait({first}, timeout=self.HEADERS_WAIT)
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            chunk = await first
        finally:
            first.cancel()  # (the client went away before the first events: stop waiting for them)
        while chunk is not None and not chunk.endswith(DONE):
            await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
            chunk = await anext(chunks, None)
        await send({"type": "http.response.body", "body": (chunk or "").encode(), "more_body": False})
        await chunks.aclose()



class OneSendPerPass:
    """A transport that sends, in one system call, everything written to it during one pass of the event
    loop (the first write schedules the send for the end of the pass): a stream's headers and first events,
    its last events and the chunked encoding's end, go out together. Each send is a system call and wakes
    the client, time taken from the decoding threads where cores are few. Everything else is the wrapped
    transport's."""

    def __init__(self, transport):
        self._transport, self._pending = transport, []

    def write(self, data) -> None:
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._send)
        self._pending.append(bytes(data))

    def _send(self) -> None:
        data, self._pending = b"".join(self._pending), []
        if data and not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self._send()
        self._transport.close()

    def __getattr__(self, name):
        return getattr(self._transport, name)



def http_protocol(read_timeout: float = READ_TIMEOUT):
    """uvicorn's HTTP/1.1 protocol over OneSendPerPass transports: httptools' (llhttp, C), which parses and
    frames a stream in less time than h11's pure Python (docs/benchmarks.md, Serving). Two rules of its own:

    - a request llhttp cannot parse (a bad request line, a negative or 20-digit Content-Length, Content-Length
      with Transfer-Encoding, bytes after a body that begin no request) is answered 400 with an OpenAI error
      object naming llhttp's reason, as every other error (uvicorn answers in text), and the connection closes;
      bytes that follow a body whose answer is already streaming get it after that answer, not inside it;
    - a request must arrive whole within read_timeout seconds of its connection or of its first byte, else
      408 (an error object) and the connection closes: a client that stalls half-way no longer holds its
      connection, and the handler reading its body, for ever."""
    import httptools
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class Protocol(HttpToolsProtocol):
        read_timer: asyncio.TimerHandle | None = None  # runs while a request is arriving
        refusal: tuple | None = None  # (status, message, code) to answer once the answer on its way is sent

        def connection_made(self, transport) -> None:
            super().connection_made(OneSendPerPass(transport))
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def data_received(self, data: bytes) -> None:
            self._unset_keepalive_if_required()
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade:
                self._unsupported_upgrade_warning()  # (ws="none": an upgrade is served as a plain request)
            except httptools.HttpParserError as e:
                self._malformed(str(e))

        def _malformed(self, reason: str) -> None:
            if self.cycle is not None and not self.cycle.response_complete:
                reason += " (after a request's body: is its Content-Length shorter than the body?)"
            self._refuse(400, f"malformed HTTP request: {reason}", "malformed_request")

        def _arm(self) -> None:
            if self.read_timer is None:
                self.read_timer = self.loop.call_later(read_timeout, self._timed_out)

        def _disarm(self) -> None:
            if self.read_timer is not None:
                self.read_timer.cancel()
                self.read_timer = None

        def _timed_out(self) -> None:
            self.read_timer = None
            self._refuse(408, f"the request did not arrive within {read_timeout:g} s", "request_timeout")

        def _refuse(self, status: int, message: str, code: str) -> None:
            """Answer with an error object and close the connection (an ASGI cycle still reading its body gets a
            disconnect); while an answer is being sent, after it (reading stops meanwhile)."""
            self._disarm()
            cycle = self.cycle
            if cycle is not None and cycle.response_started and not cycle.response_complete:
                self.refusal = (status, message, code)
                self.flow.pause_reading()
                return
            if self.transport.is_closing():
                return
            body = json.dumps(error_body(message, code=code)).encode()
            head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n".encode()]
            head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
            head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                     b"connection: close\r\n\r\n"]
            self.transport.write(b"".join(head) + body)
            self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.refusal is not None and not self.pipeline:
                refusal, self.refusal = self.refusal, None
                self._refuse(*refusal)
    return Protocol



def bind(host: str, port: int):
    """A listening socket on host:port (port 0: any free one); a port in use is a UserError. Its protocol
    is named (IPPROTO_TCP): asyncio turns Nagle's algorithm off (TCP_NODELAY) only on connections of such
    sockets, and with it on, a stream's later chunk waits for the client's delayed acknowledgement of the
    one before (a keep-alive client gets a reply's end tens of ms late)."""
    import socket
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        why = "the port is in use" if e.errno == 98 else e.strerror or str(e)
        raise UserError(f"cannot listen on {host}:{port}: {why}")
    sock.set_inheritable(True)
    return sock



def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

