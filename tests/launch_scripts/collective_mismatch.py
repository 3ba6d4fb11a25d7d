"""The ranks disagree on an all-reduce's size: gloo aborts the process natively
("terminate called after throwing an instance of 'gloo::EnforceNotMet'")."""

import torch
import torch.distributed as dist

import phalanx as px

px.init()
dist.all_reduce(torch.ones(4 if px.rank() == 0 else 8))
px.shutdown()
