"""Fixtures the rollout tests share: the GCS emulator's gs:// root (tests/support/gcs_emulator.py)."""

import pytest


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """The emulator's gs:// root for this module (create-only writes honoured, as GCS does)."""
    pytest.importorskip("gcp_storage_emulator", reason="pip install -e '.[test]' (gcp-storage-emulator)")
    from tests.support.gcs_emulator import gcs_emulator

    with gcs_emulator("posttrain-rl", str(tmp_path_factory.mktemp("gcs") / "emulator.log")):
        yield "gs://posttrain-rl"
