from preheat.cli import main

main()
