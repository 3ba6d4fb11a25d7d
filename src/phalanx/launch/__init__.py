"""Starting workers: `phalanx run` (a script on N workers per node, through PyTorch's elastic
agent) and `px.spawn` (a function on N workers of this machine, from a notebook or a script).
"""


# The package, by role:
#   cli.py         `phalanx run`: the flags, their checks, and `main`, from command line to exit
#                  status (its docstring is `phalanx run --help`)
#   agent.py       the elastic agent that runs this node's workers and announces restarts
#   rendezvous.py  torch's static rendezvous, with a fresh workers' store per attempt
#   failures.py    turning failed workers into the one message the user reads
#   worker.py      the worker's entry point: runs the user's script, records its failure
#   scratch.py     a launcher's temporary directory, locked while it lives (the next removes
#                  what a killed one left)
#   spawn.py       `px.spawn`: workers of a function rather than a script, without the agent
#                  (from a notebook too); the test harness (phalanx.testing) is built on it
