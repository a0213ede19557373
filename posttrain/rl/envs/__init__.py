"""RL environments on token ids: single-turn verifiable tasks and multi-turn tool use."""

from posttrain.rl.envs.base import Env, Policy, Step, Task, Trajectory
from posttrain.rl.envs.chat import ChatEnv, SingleTurnEnv, continuation
from posttrain.rl.envs.runner import BatchPolicy, run_episode, run_episodes
from posttrain.rl.envs.tool import (
    TOOL_LIMITS,
    TOOL_SYSTEM_PROMPT,
    ToolCall,
    ToolCallEnv,
    ToolCallError,
    ToolEnv,
    parse_tool_call,
    run_python,
)

__all__ = [
    "BatchPolicy",
    "ChatEnv",
    "Env",
    "Policy",
    "SingleTurnEnv",
    "Step",
    "TOOL_LIMITS",
    "TOOL_SYSTEM_PROMPT",
    "Task",
    "ToolCall",
    "ToolCallEnv",
    "ToolCallError",
    "ToolEnv",
    "Trajectory",
    "continuation",
    "parse_tool_call",
    "run_episode",
    "run_episodes",
    "run_python",
]
