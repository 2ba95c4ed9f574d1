"""reshard's progress bar counts in the unit family of its summary line (MiB/GiB)."""

from __future__ import annotations


def test_reshard_progress_bar_counts_binary_units() -> None:
    from rich.console import Console
    from rich.progress import Progress

    from shardctl.cli.reshard import progress_columns

    console = Console(width=200, record=True, force_terminal=False)
    progress = Progress(*progress_columns(), console=console, auto_refresh=False)
    task = progress.add_task("resharding", total=600 * 2**20)
    progress.update(task, completed=300 * 2**20)
    line = "".join(str(c) for c in progress.make_tasks_table(progress.tasks).columns[2].cells)
    assert "300.0/600.0 MiB" in line, line
    speed = progress.columns[3]
    progress.tasks[0].finished_speed = 5 * 2**20
    assert str(speed.render(progress.tasks[0])) == "5.00 MiB/s"
