"""The rollout plane: agents, the store protocol and its client and service, runners, the span
batcher, the runner service, asynchronous collection and staleness, tasks."""
