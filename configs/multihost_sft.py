"""SFT of the tiny decoder across several processes (hosts): an example multi-host config.

Run the same command on every host; see README "Several hosts". On a TPU pod slice nothing more is
needed. Elsewhere set the coordinator, process count and index (here or on the command line, or
as $JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES, $JAX_PROCESS_ID):

    python -m posttrain.main --config configs/multihost_sft.py \
        --config.distributed.coordinator=10.0.0.1:8476 --config.distributed.num_processes=2 \
        --config.distributed.process_id=0      # 1 on the second host

The workdir and data must be reachable from every host (a shared file system or gs://).
"""

from configs.sft_tiny import get_config as sft_config


def get_config():
    cfg = sft_config()
    cfg.workdir = "runs/multihost_sft"
    cfg.mesh.data = -1  # the batch over every device of every host
    cfg.train.batch_size = 32  # global rows: a multiple of the processes and the batch axes
    cfg.data.packing = False  # the same records per global batch for any process count
    cfg.distributed.heartbeat_timeout_s = 60  # a lost host stops the others within a minute
    return cfg
