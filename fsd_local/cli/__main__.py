from fsd_local.cli.main import main

main()
