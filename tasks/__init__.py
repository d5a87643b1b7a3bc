"""Zero-shot evaluation tasks: HellaSwag and LAMBADA, scored as EleutherAI's
lm-evaluation-harness scores them. Each module declares its `TASK` (tasks/task.py: how its items
load, how a batch of them is scored, what their sums mean); `Task.evaluate` spreads the items
over the data-parallel ranks. `train.hellaswag=true` scores HellaSwag at every evaluation;
tools/evaluate.py scores any of them (`task=<name>`)."""

from omegaconf import DictConfig

from tasks import hellaswag, lambada
from tasks.task import Task

TASKS: dict[str, Task] = {task.name: task for task in (hellaswag.TASK, lambada.TASK)}

__all__ = ["TASKS", "Task", "for_training", "hellaswag", "lambada"]


def for_training(train: DictConfig, cache_dir: str) -> list[tuple[Task, list[dict]]]:
    """The tasks the trainer scores at every evaluation, with their items: HellaSwag's under
    `train.hellaswag=true`."""
    items = hellaswag.for_training(train, cache_dir)
    return [(hellaswag.TASK, items)] if items else []
