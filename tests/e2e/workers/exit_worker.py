"""A short healthy job whose script just returns: no close(), no destroy_process_group(), no
os._exit. The sentinel must leave nothing behind that turns a clean end into an abort."""

import datetime
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import nansentinel


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)]
    model = DDP(torch.nn.Sequential(*layers))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    sentinel = nansentinel.Sentinel(model, optimizer)
    for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 5):
        x = sentinel.check_batch(torch.randn(4, 8))
        loss = model(x).pow(2).mean()
        sentinel.check_loss(loss)
        loss.backward()
        sentinel.step()
        optimizer.zero_grad(set_to_none=True)


main()
