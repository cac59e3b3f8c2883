"""``python -m kvstore.tools.bench``: the same command as ``kvstore bench``."""

import typer

from kvstore.tools.bench.command import bench_command

typer.run(bench_command)
