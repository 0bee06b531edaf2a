"""`python pretrain.py --config configs/<name>.yaml`: the same CLI as `python -m fulmen.pretrain`."""

from fulmen.pretrain.cli import main

if __name__ == "__main__":
    main()
