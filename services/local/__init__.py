"""Local deployment: `lorabus up` and the servers it (and the tests) start on this machine.

Nothing under `services/` imports this package except `services/cli.py` (for `lorabus up`): the
services run the same whether a launcher, compose or an operator started them.
"""
