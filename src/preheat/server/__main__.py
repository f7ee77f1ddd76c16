"""``python -m preheat.server [MODEL] [OPTIONS]`` = ``preheat serve``."""

from preheat.cli import run
from preheat.cli.serve import serve_command

if __name__ == "__main__":
    run(serve_command, prog_name="python -m preheat.server")
