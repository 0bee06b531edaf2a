"""`python -m fulmen.pretrain`: see fulmen.pretrain.cli."""

from fulmen.pretrain.cli import main

if __name__ == "__main__":
    main()
