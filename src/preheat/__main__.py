from preheat.cli import run

run()
