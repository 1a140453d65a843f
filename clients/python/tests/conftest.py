"""Fixtures: a real `ratchet serve` process, from the binary `RATCHET_BIN` names.

Without `RATCHET_BIN` every test is skipped, saying why; with `CI=true` they fail instead.
The shared server has two tenants' tokens and a catalog of agents, each with a scripted model,
so that one process serves every behaviour the tests need.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import httpx
import pytest

from ratchet_client import Client

#: How long anything the tests wait for may take on a loaded two-core machine.
DEADLINE = 30.0

TOKENS = {"acme": "acme-token-0123456789abcdef", "globex": "globex-token-0123456789abcdef"}

ADD = {"name": "add", "arguments": {"a": 2, "b": 3}}
#: Each agent's script: reply i answers the run's i-th model call, the last one repeats.
SCRIPTS: Dict[str, dict] = {
    "adder": {"replies": [{"text": "Let me add.", "tool_calls": [ADD]}, {"text": "The sum is 5."}]},
    "gated": {"replies": [{"text": "Let me add.", "tool_calls": [ADD]}, {"text": "The sum is 5."}]},
    # Several steps streamed word by word: a run long enough to pause, cancel or kill midway.
    "slow": {
        "replies": [
            {"text": "one two three four five", "tool_calls": [ADD], "chunk_delay_ms": 80},
            {"text": "six seven eight nine ten", "tool_calls": [ADD], "chunk_delay_ms": 80},
            {"text": "eleven twelve thirteen fourteen", "tool_calls": [ADD], "chunk_delay_ms": 80},
            {"text": "fifteen sixteen seventeen eighteen", "tool_calls": [ADD], "chunk_delay_ms": 80},
            {"text": "all done now, the sum is five", "chunk_delay_ms": 80},
        ]
    },
    "tight": {"replies": [{"text": "Let me add.", "tool_calls": [ADD]}, {"text": "The sum is 5."}]},
}
AGENTS = {
    "adder": "tools: [add]\n",
    "gated": "tools: [add]\napproval:\n  add: always\n",
    "slow": "tools: [add]\n",
    # One step: its only model call concludes, and a reply that still asks for a tool spends
    # the budget, so the run fails and can be continued.
    "tight": "tools: [add]\nlimits:\n  max_steps: 1\n",
}
#: Agents of a model profile instead of a script.
PROFILE_AGENTS = {"broken": "unreachable"}
#: A model nothing answers, tried once: its runs fail with `llm_error`, and can be retried.
UNREACHABLE_MODEL = """[models.unreachable]
provider = "openai"
model = "nothing"
base_url = "http://127.0.0.1:9/v1"
max_retries = 0
"""


def ratchet_bin() -> Path:
    path = os.environ.get("RATCHET_BIN")
    if not path:
        if os.environ.get("CI") == "true":
            pytest.fail("RATCHET_BIN must name the ratchet binary in CI (scripts/test sets it)")
        pytest.skip("set RATCHET_BIN to a built ratchet binary to test the client against it")
    if not Path(path).is_file():
        pytest.fail(f"RATCHET_BIN={path} is not a file")
    return Path(path)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def write_catalog(directory: Path) -> Path:
    catalog = directory / "agents"
    catalog.mkdir()
    for agent, frontmatter in AGENTS.items():
        (catalog / f"{agent}.json").write_text(json.dumps(SCRIPTS[agent]))
        definition = (
            f"---\nid: {agent}\ndescription: Adds numbers\nmodel: scripted:{agent}.json\n"
            f"{frontmatter}---\nYou add numbers.\n"
        )
        (catalog / f"{agent}.md").write_text(definition)
    for agent, model in PROFILE_AGENTS.items():
        definition = f"---\nid: {agent}\ndescription: Fails\nmodel: {model}\n---\nYou fail.\n"
        (catalog / f"{agent}.md").write_text(definition)
    return catalog


@dataclass
class Server:
    """One `ratchet serve` process; `restart` starts it again on the same port and database."""

    binary: Path
    directory: Path
    args: List[str]
    port: int = field(default_factory=free_port)
    process: Optional[subprocess.Popen] = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.starts += 1
        log = open(self.directory / f"serve-{self.starts}.log", "wb")
        self.process = subprocess.Popen(
            [str(self.binary), "serve", "--listen", f"127.0.0.1:{self.port}", *self.args],
            stdout=subprocess.DEVNULL,
            stderr=log,
            env={**os.environ, "RATCHET_LOG": "warn"},
            cwd=self.directory,
        )
        log.close()
        self.wait_ready()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"ratchet serve exited {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"ratchet serve was not ready within {DEADLINE} s:\n{self.log()}")

    def kill(self) -> None:
        """SIGKILL: nothing is flushed, nothing is said goodbye to."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=DEADLINE)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=DEADLINE)

    def log(self) -> str:
        return "\n".join(
            path.read_text(errors="replace") for path in sorted(self.directory.glob("serve-*.log"))
        )


def serve(binary: Path, directory: Path, config: str, model: Optional[dict] = None) -> Server:
    (directory / "ratchet.toml").write_text(UNREACHABLE_MODEL + config)
    args = [
        "--db", f"sqlite://{directory / 'ratchet.db'}",
        "--workspace", str(directory),
        "--config", str(directory / "ratchet.toml"),
        "--agents", str(write_catalog(directory)),
    ]
    if model is not None:
        (directory / "model.json").write_text(json.dumps(model))
        args += ["--model", f"scripted:{directory / 'model.json'}"]
    return Server(binary, directory, args)


def tokens_config() -> str:
    return "".join(
        f'[[tokens]]\ntenant = "{tenant}"\nsha256 = "{hashlib.sha256(token.encode()).hexdigest()}"\n'
        for tenant, token in TOKENS.items()
    )


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory):
    """The server most tests share: tokens for two tenants, and the agents' catalog."""
    binary = ratchet_bin()
    shared = serve(binary, tmp_path_factory.mktemp("shared"), tokens_config(), SCRIPTS["adder"])
    shared.start()
    yield shared
    shared.stop()


@pytest.fixture
def client(server: Server):
    with Client(server.url, token=TOKENS["acme"], timeout=DEADLINE) as client:
        yield client
