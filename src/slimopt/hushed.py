"""Importing this module installs ``peer_logs.hush()``.

For processes that begin by importing a list of modules before any code of ours runs: the forkserver of
``slimopt compare`` preloads torch, transformers (which imports torchao) and slimopt, and would print the peers'
load chatter that the command line filters everywhere else. It is first in that list.
"""

from slimopt import peer_logs

peer_logs.hush()
