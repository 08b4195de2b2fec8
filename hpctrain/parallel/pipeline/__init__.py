"""Pipeline parallelism: schedules as data, a simulator, lowering to communication actions."""
