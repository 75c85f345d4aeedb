"""A loopback S3 (moto's server mode) and a TCP relay that cuts large responses, for the s3:// model tests."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

from server_process import free_port

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def moto_s3() -> Iterator[str]:
    """moto's ThreadedMotoServer on 127.0.0.1; yields its URL (AWS_ENDPOINT_URL_S3)."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def s3_client(endpoint: str):
    import boto3

    keys = {"aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"]}
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **keys)


def upload(endpoint: str, bucket: str, prefix: str, files: dict[str, bytes]) -> None:
    client = s3_client(endpoint)
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=bucket)
    for path, content in files.items():
        client.put_object(Bucket=bucket, Key=f"{prefix}/{path}", Body=content)


class CuttingRelay:
    """Relays 127.0.0.1:<port> to `upstream`, but drops any connection once it has carried
    `cut_after` bytes back: small answers (listings) pass, a large object never arrives whole."""

    def __init__(self, upstream: str, cut_after: int):
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.cut_after = cut_after
        self.listener = socket.create_server(("127.0.0.1", free_port()))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.cuts = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self._pipe, args=(client, server, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, self.cut_after), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, limit: int | None) -> None:
        carried = 0
        try:
            while chunk := source.recv(65536):
                if limit is not None and carried + len(chunk) > limit:
                    sink.sendall(chunk[: limit - carried])
                    self.cuts += 1
                    break
                sink.sendall(chunk)
                carried += len(chunk)
        except OSError:
            pass
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self.listener.close()
