"""The locust load shape of $KVSIEVE_LOADTEST_STAGES (loadtest/stages.py),
users added and removed at $KVSIEVE_LOADTEST_SPAWN_RATE per second.
loadtest/run.py --stages passes this file to locust beside locustfile.py."""

from __future__ import annotations

import os

from locust import LoadTestShape

from stages import SPAWN_RATE_ENV, STAGES_ENV, parse_stages, users_at


class Stages(LoadTestShape):
    def __init__(self):
        super().__init__()
        self.stages = parse_stages(os.environ[STAGES_ENV])
        self.spawn_rate = float(os.environ.get(SPAWN_RATE_ENV, "5"))

    def tick(self):
        users = users_at(self.stages, self.get_run_time())
        return None if users is None else (users, self.spawn_rate)
