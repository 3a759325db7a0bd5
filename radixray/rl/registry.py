"""Tasks by name: the registered ones (one-turn in :mod:`radixray.rl.tasks`, multi-turn in
:mod:`radixray.rl.tool_tasks`) or a user's by import path."""

from __future__ import annotations

from radixray.rl.plugins import is_import_path, load_object
from radixray.rl.tasks import TASKS, Task
from radixray.rl.tool_tasks import TOOL_TASKS


def known_tasks() -> dict[str, Task]:
    return {**TASKS, **TOOL_TASKS}


def get_task(name: str) -> Task:
    """The task called ``name``: a registered one, or a user's :class:`Task` subclass or
    instance named by import path (``package.module:MyTask``). ValueError names it and the
    known tasks."""
    known = known_tasks()
    if name in known:
        return known[name]
    if not is_import_path(name):
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(known)}, or an "
                         f"import path to a Task subclass ('package.module:MyTask')")
    obj = load_object(name, "task")
    task = obj() if isinstance(obj, type) and issubclass(obj, Task) else obj
    if not isinstance(task, Task):
        raise ValueError(f"task {name!r} is a {type(obj).__name__}, not a radixray.rl.tasks.Task")
    return task
