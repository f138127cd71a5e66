"""Helpers for testing jaxckpt and stores built on it: the multi-process launcher and what a launched process knows.

Importing this package does not import jax.
"""
from jaxckpt.testing.agents import agent_processes, remove_agents
from jaxckpt.tools.launcher import Job, ProcResult, expect_ok, free_port, free_ports, launch, start
from jaxckpt.tools.node import NodeInfo, init_from_env, kill_node, node_info

__all__ = ["Job", "NodeInfo", "ProcResult", "agent_processes", "expect_ok", "free_port", "free_ports", "init_from_env",
           "kill_node", "launch", "node_info", "remove_agents", "start"]
