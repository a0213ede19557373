"""A local Google Cloud Storage emulator (`gcp-storage-emulator`, in memory) for tests, and the
environment that points gcsfs, google-cloud-storage and tensorstore (orbax) at it.

Environment set while it runs:
- `STORAGE_EMULATOR_HOST=http://127.0.0.1:PORT`: gcsfs and google-cloud-storage talk to it,
  anonymously.
- `TENSORSTORE_GCS_HTTP_URL=http://127.0.0.1:PORT` and `GOOGLE_AUTH_TOKEN_FOR_TESTING=test`:
  tensorstore's `gcs` kvstore (orbax's arrays) talks to it with a dummy bearer token.
- `GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`: gcsfs's default filesystem first asks the gRPC
  storage-control API for the bucket's layout, which the emulator does not serve (each call waits
  out a 60 s timeout); the plain `GCSFileSystem` is registered for gs:// in this process too.

Two gaps of the emulator are filled here (`python tests/support/gcs_emulator.py start ...` runs it with
the fixes): its media downloads lack the `x-goog-generation` header real GCS sends, so tensorstore
reads generation 0 and its next conditional write (orbax's OCDBT manifest) fails with "Malformed
StorageGeneration"; and its uploads ignore the create-only precondition `ifGenerationMatch=0`, which
real GCS answers with 412 when the object exists (the RL work queue's leases rely on it). Other
generation preconditions are still ignored.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

ENV = (
    "STORAGE_EMULATOR_HOST",
    "TENSORSTORE_GCS_HTTP_URL",
    "GOOGLE_AUTH_TOKEN_FOR_TESTING",
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _use_plain_gcsfs() -> None:
    """gs:// and gcs:// → gcsfs.core.GCSFileSystem (no storage-control lookups), fresh instances."""
    import fsspec
    from gcsfs.core import GCSFileSystem

    for protocol in ("gs", "gcs"):
        fsspec.register_implementation(protocol, GCSFileSystem, clobber=True)
    GCSFileSystem.clear_instance_cache()


@contextlib.contextmanager
def gcs_emulator(bucket: str, log_path: str) -> Iterator[str]:
    """Run the emulator on a free loopback port with `bucket` created; yields its URL. The
    environment (module docstring) is set for the duration and restored after."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "start",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--in-memory",
                "--default-bucket",
                bucket,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=os.path.dirname(log_path),
        )
    saved = {k: os.environ.get(k) for k in ENV}
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError as e:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the GCS emulator did not start (exit {proc.poll()}); see {log_path}") from e
                time.sleep(0.1)
        os.environ.update(
            {
                "STORAGE_EMULATOR_HOST": url,
                "TENSORSTORE_GCS_HTTP_URL": url,
                "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test",
                "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            }
        )
        _use_plain_gcsfs()
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        import gcsfs.core

        gcsfs.core.GCSFileSystem.clear_instance_cache()


def _serve(argv: list[str]) -> None:
    """The emulator's command line, with the generation headers on media downloads and create-only
    uploads (`ifGenerationMatch=0`: 412 when the object exists, atomically)."""
    import threading
    from http import HTTPStatus

    from gcp_storage_emulator.handlers import objects

    plain_insert, creating = objects.insert, threading.Lock()

    def insert(request, response, storage, *args, **kwargs):
        if request.query.get("ifGenerationMatch") != ["0"]:
            return plain_insert(request, response, storage, *args, **kwargs)
        name = request.query["name"][0] if "name" in request.query else request.data["meta"].get("name")
        with creating:
            try:
                storage.get_file_obj(request.params["bucket_name"], name)
            except Exception:  # not there: create it
                return plain_insert(request, response, storage, *args, **kwargs)
            response.status = HTTPStatus.PRECONDITION_FAILED
            response.json({"error": {"code": 412, "message": f"{name}: ifGenerationMatch=0 and it exists"}})

    objects.insert = insert
    plain = objects.download

    def download(request, response, storage, *args, **kwargs):
        plain(request, response, storage, *args, **kwargs)
        try:
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        except Exception:  # not found: the plain handler answered 404
            return
        response["x-goog-generation"] = obj["generation"]
        response["x-goog-metageneration"] = obj["metageneration"]

    objects.download = download  # before the server module binds its routes
    from gcp_storage_emulator.__main__ import main

    main(argv)


if __name__ == "__main__":
    _serve(sys.argv[1:])
