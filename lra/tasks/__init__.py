"""LRA tasks: one file per task, each registered by name."""
from .base import DataStatus, Split, Task, TaskSpec, get_task, list_tasks, register_task

__all__ = ["DataStatus", "Split", "Task", "TaskSpec", "get_task", "list_tasks", "register_task"]
