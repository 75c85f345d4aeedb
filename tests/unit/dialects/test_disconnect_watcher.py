"""disconnect.py: the request thread's watch on its client while a whole response is generated,
on a real socket pair (the server's end is watched, the test plays the client)."""

from __future__ import annotations

import queue
import socket
import struct
import threading

import pytest

from lmi_serve.dialects.common.disconnect import ClientConnection, wait_for_results
from lmi_serve.engine.generation import Generation
from lmi_serve.engine.handle import RequestHandle
from lmi_serve.engine.types import FinishReason, GenerationRequest, TokenEvent
from lmi_serve.errors import ClientGone, Timeout

PIPELINED = b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"


def token(text: str, finish: FinishReason | None = None) -> TokenEvent:
    return TokenEvent(7, text, -0.1, False, finish)


class CountingConnection(ClientConnection):
    """Tells a test how often the waiter looked at the socket."""

    def __init__(self, sock: socket.socket):
        super().__init__(sock)
        self.checks = 0
        self.checked_thrice = threading.Event()

    def closed(self) -> bool:
        self.checks += 1
        if self.checks >= 3:
            self.checked_thrice.set()
        return super().closed()


@pytest.fixture
def pair():
    server, client = socket.socketpair()
    yield server, client
    server.close()
    client.close()


def generation(*prompt_lens: int) -> Generation:
    """A Generation of one sequence per prompt length, fed by the test instead of an engine."""
    sink = queue.SimpleQueue()
    return Generation([RequestHandle(GenerationRequest(prompt_ids=tuple(range(n))), None, sink=sink, index=i)
                       for i, n in enumerate(prompt_lens)], sink)


def texts(results) -> list[str]:
    return [r.text for r in results]


def finish_after_checks(connection: CountingConnection, target: RequestHandle) -> threading.Thread:
    """Push the last events once the waiter has looked at the socket a few times (no sleeps)."""
    def run():
        connection.checked_thrice.wait(60)
        target.push(token("a"))
        target.push(token("b", FinishReason.LENGTH))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_an_open_idle_connection_is_not_closed(pair):
    server, _client = pair
    assert not ClientConnection(server).closed()


def test_a_closed_peer_is_closed(pair):
    server, client = pair
    client.close()
    assert ClientConnection(server).closed()


def test_a_reset_connection_is_closed():
    listener = socket.create_server(("127.0.0.1", 0))
    with listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
        with server:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()  # RST instead of FIN
            assert ClientConnection(server).closed()


def test_pipelined_bytes_mean_the_client_is_there_and_are_left_unread(pair):
    server, client = pair
    client.sendall(PIPELINED)
    connection = ClientConnection(server)
    assert not connection.closed() and not connection.closed()
    assert server.recv(len(PIPELINED), socket.MSG_WAITALL) == PIPELINED


def test_peer_closing_while_waiting_cancels_every_sequence(pair):
    server, client = pair
    gen = generation(3, 3)
    gen.handles[0].push(token("a"))  # generation under way, never finishing
    client.close()
    with pytest.raises(ClientGone):
        wait_for_results(gen, ClientConnection(server))
    assert all(h.cancelled for h in gen.handles)


def test_peer_closing_while_still_queued_cancels_it(pair):
    """No event at all (the request waits for a row): the poll timeout still gets the socket looked at."""
    server, client = pair
    gen = generation(3)
    connection = CountingConnection(server)
    closer = threading.Thread(target=lambda: (connection.checked_thrice.wait(60), client.close()), daemon=True)
    closer.start()
    with pytest.raises(ClientGone):
        wait_for_results(gen, connection)
    assert gen.handles[0].cancelled


def test_peer_sending_data_is_no_disconnect(pair):
    server, client = pair
    client.sendall(PIPELINED)
    gen = generation(4)
    connection = CountingConnection(server)
    pusher = finish_after_checks(connection, gen.handles[0])
    (result,) = wait_for_results(gen, connection)
    pusher.join()
    assert result.prompt_tokens == 4 and result.text == "ab" and result.finish_reason is FinishReason.LENGTH
    assert connection.checks >= 3
    assert server.recv(len(PIPELINED), socket.MSG_WAITALL) == PIPELINED


def test_every_sequence_is_waited_for_and_kept_in_order(pair):
    server, _client = pair
    gen = generation(3, 3)
    gen.handles[1].push(token("x", FinishReason.EOS_TOKEN))
    connection = CountingConnection(server)
    pusher = finish_after_checks(connection, gen.handles[0])
    results = wait_for_results(gen, connection)
    pusher.join()
    assert texts(results) == ["ab", "x"]


def test_a_sequence_failing_before_any_token_raises_its_kind_and_cancels_the_others(pair):
    server, _client = pair
    gen = generation(3, 3)
    gen.handles[0].push(TokenEvent.failure("waited too long", kind=Timeout))
    with pytest.raises(Timeout, match="waited too long"):
        wait_for_results(gen, ClientConnection(server))
    assert gen.handles[1].cancelled


def test_a_failure_after_tokens_is_the_sequences_last_event(pair):
    server, _client = pair
    gen = generation(3)
    gen.handles[0].push(token("a"))
    gen.handles[0].push(TokenEvent.failure("the model broke"))
    (result,) = wait_for_results(gen, ClientConnection(server))
    assert result.text == "a" and result.error == "the model broke"


def test_without_a_connection_waiting_is_plain_waiting():
    """Outside a request (or with Flask's test client) there is no socket: nothing is watched."""
    gen = generation(3)
    gen.handles[0].push(token("a", FinishReason.LENGTH))
    assert ClientConnection.current() is None
    (result,) = wait_for_results(gen)
    assert result.text == "a" and gen.handles[0].cancelled  # cancelling a finished request is a no-op


def test_the_current_connection_is_the_gunicorn_socket(pair):
    from flask import Flask

    server, _client = pair
    app = Flask(__name__)
    with app.test_request_context(environ_base={"gunicorn.socket": server}):
        assert isinstance(ClientConnection.current(), ClientConnection)
    with app.test_request_context():
        assert ClientConnection.current() is None
