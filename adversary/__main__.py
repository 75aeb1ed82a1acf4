"""`python -m neuroshard.adversary`: the same as `neuroshard-adversary`."""

from .cli import command

command()
