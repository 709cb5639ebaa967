"""What the ranks agree on, and how they fail together: sections, the history,
replicas, the launch's layout, one voice, preemption notices."""
