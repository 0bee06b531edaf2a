"""The strategies started the ways Fabric supports, each training 2 ranks to eager's losses: Fabric's own
launcher (`python train.py`, it starts the other rank), two nodes of one process started by hand (NODE_RANK),
two torchrun nodes, and a 2-node SLURM allocation (srun's environment)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from tests.strategies import workers

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(Path(__file__).with_name("fabric_script.py"))
# the environment of the process running the tests must not leak into the launched ones
LAUNCH_VARIABLES = ("SLURM_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_",
                    "NODE_RANK", "TORCHELASTIC_")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_VARIABLES)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return {**env, **extra}


def _run(commands: list[tuple[list[str], dict[str, str]]], out: Path) -> dict:
    procs = [subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd, env in commands]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=600)[0])
    finally:
        for proc in procs:
            proc.kill()
    for proc, log in zip(procs, logs):
        assert proc.returncode == 0, log[-4000:]
    facts = json.loads(out.read_text())
    # every launch trains the same 2-rank run, so its losses are eager's on the global batch
    assert facts["world"] == 2 and facts["sampler"] == {"num_replicas": 2, "rank": 0}
    torch.testing.assert_close(facts["losses"], workers.eager_training(2, "norm")["losses"], rtol=1e-5, atol=0)
    return facts


def _script(strategy: str, devices: int, nodes: int, out: Path) -> list[str]:
    return [SCRIPT, "--strategy", strategy, "--devices", str(devices), "--num-nodes", str(nodes), "--out", str(out)]


def test_fabric_launcher(tmp_path):
    out = tmp_path / "out.json"
    facts = _run([([sys.executable, *_script("fsdp", 2, 1, out)], _environment())], out)
    assert facts["environment"] == "LightningEnvironment"
    assert facts["ranks"] == [[0, 0, 0], [1, 0, 1]]  # (global, node, local) of each rank


def test_two_nodes_by_hand(tmp_path):
    out, port = tmp_path / "out.json", str(_free_port())
    facts = _run([([sys.executable, *_script("ddp", 1, 2, out)],
                   _environment(NODE_RANK=str(node), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)) for node in (0, 1)],
                 out)
    assert facts["environment"] == "LightningEnvironment"
    assert facts["ranks"] == [[0, 0, 0], [1, 1, 0]]


def test_two_torchrun_nodes(tmp_path):
    out, port = tmp_path / "out.json", str(_free_port())
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--master-addr", "127.0.0.1", "--master-port", port]
    facts = _run([([*torchrun, "--node-rank", str(node), *_script("fsdp", 1, 2, out)], _environment())
                  for node in (0, 1)], out)
    assert facts["environment"] == "TorchElasticEnvironment"
    assert facts["ranks"] == [[0, 0, 0], [1, 1, 0]]


def test_slurm_allocation_of_two_nodes(tmp_path):
    out, port = tmp_path / "out.json", str(_free_port())
    slurm = dict(SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="1", SLURM_NNODES="2", SLURM_LOCALID="0",
                 SLURM_JOB_NAME="fulmen-tests", SLURM_JOB_ID="4242", SLURM_NODELIST="127.0.0.1", MASTER_PORT=port)
    facts = _run([([sys.executable, *_script("fsdp", 1, 2, out)],
                   _environment(**slurm, SLURM_PROCID=str(task), SLURM_NODEID=str(task))) for task in (0, 1)], out)
    assert facts["environment"] == "SLURMEnvironment"
    assert facts["ranks"] == [[0, 0, 0], [1, 1, 0]]
