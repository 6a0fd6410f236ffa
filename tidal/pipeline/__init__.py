"""The RL pipeline driver: one RL step streams prompt groups rollout -> inference -> actor on device workers."""
