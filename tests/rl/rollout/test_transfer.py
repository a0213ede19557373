"""rl/rollout/transfer.py without a transfer server: who may read the address file."""

import os

from posttrain.rl.rollout import workqueue
from posttrain.rl.rollout.workqueue import WorkQueue


def test_the_address_file_is_this_users_only_from_its_creation(tmp_path, monkeypatch):
    """learner.json carries the run token: its temporary file is created 0600 (under any umask),
    not made so after it was written. The mode is read wherever the file is touched after its
    creation: at a chmod (before it acts) and at the rename."""
    queue, modes = WorkQueue(str(tmp_path)), []
    chmod, replace = os.chmod, os.replace

    def seen(src) -> None:
        modes.append(os.stat(src).st_mode & 0o777)

    monkeypatch.setattr(workqueue.os, "chmod", lambda src, mode: (seen(src), chmod(src, mode)))
    monkeypatch.setattr(workqueue.os, "replace", lambda src, dst: (seen(src), replace(src, dst)))
    old = os.umask(0o022)
    try:
        workqueue.write_json(queue.path("learner.json"), {"token": "secret"}, mode=0o600)
    finally:
        os.umask(old)
    assert modes and set(modes) == {0o600} and os.stat(queue.path("learner.json")).st_mode & 0o777 == 0o600
