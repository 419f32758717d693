"""Run under torchrun with 2 processes: the all-reduced gradient of two ranks on batches A and
B must equal the single-process gradient on A and B together. Its argument: the module to
check (default fast_sac_multigpu; the tests give the --script copy's)."""

import importlib
import os
import sys

import numpy as np
import torch

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])
m = importlib.import_module(sys.argv[1] if len(sys.argv) > 1 else "fast_sac_multigpu")
from common import dist as D  # noqa: E402

info = D.init("gloo", "cpu")
assert info.world_size == 2
args = m.resolve_args(m.Args(env="Pendulum-v1", device="cpu", critic_hidden=32,
                             actor_hidden=32, num_atoms=11))
torch.manual_seed(100 + info.rank)  # different init per rank: broadcast must fix that
learner = m.Learner(args, 3, 1, np.array([-2.0], np.float32), np.array([2.0], np.float32),
                    torch.device("cpu"), info)
D.broadcast_(m.learner_tensors(learner), info)  # as Run does on every rank
g = torch.Generator().manual_seed(0)  # both ranks build the same two batches
obs, act = torch.randn(2, 64, 3, generator=g), torch.rand(2, 64, 1, generator=g) * 4 - 2
target = torch.rand(2, 64, 11, generator=g).softmax(-1)


def loss_fn(o, a, t):
    return -(t * learner.critics(o, a).log_softmax(-1)).sum(-1).mean()


loss_fn(obs[info.rank], act[info.rank], target[info.rank]).backward()
D.allreduce_grads_(learner.critics.parameters(), info)
averaged = [p.grad.clone() for p in learner.critics.parameters()]
learner.critics.zero_grad()
loss_fn(obs.reshape(128, 3), act.reshape(128, 1), target.reshape(128, 11)).backward()
for avg, full in zip(averaged, [p.grad for p in learner.critics.parameters()]):
    torch.testing.assert_close(avg, full, rtol=1e-5, atol=1e-6)
hashes = D.gather_strings(D.param_hash([learner.critics]), info)
assert hashes[0] == hashes[1], "broadcast did not make parameters equal"
D.shutdown(info)
# the group's threads went with it (left to the interpreter's exit, their teardown can abort
# a finished rank; see why common/dist.py imports torch._dynamo first)
threads = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
assert not any("gloo" in name for name in threads), threads
print(f"rank {info.rank}: gradients match")
