from shardctl.cli import main

main()
