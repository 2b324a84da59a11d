"""Rollouts: agents run through the recording proxy, for a trainer that wants them now.

Each module here orchestrates agent episodes as trajstore sessions (through `trajstore.client`)
and hands the recorded tokens to a trainer; the trainer's own replay of what is stored lives
in `trajstore.trainer`, which never talks to an engine or a proxy.

- `trajstore.rollout.verl_loop`: verl's agent loop `trajstore` (`docs/verl.md`);
- `trajstore.rollout.trl_rollout`: TRL's `rollout_func` (`docs/trl.md`);
- `trajstore.rollout.live_agents`: the toy agents of `trajstore train` (`trajstore.live`).
"""
