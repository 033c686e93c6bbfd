from meridian.cli.main import main

main()
