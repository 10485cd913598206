"""Worker for the multi-host test: one gloo all_reduce across every rank, then a receipt.

Writes ``<outdir>/<hostname>-rank<RANK>.json`` with the hostname, rank, world size and the
all_reduce result (which must equal the world size), so the test can check that the ranks
really talked across hosts, not just started.
"""

import datetime
import json
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.ones(1)
dist.all_reduce(t)
host = socket.gethostname()
receipt = {"hostname": host, "rank": rank, "world_size": world, "sum": float(t.item())}
Path(sys.argv[1], f"{host}-rank{rank}.json").write_text(json.dumps(receipt))
dist.destroy_process_group()
