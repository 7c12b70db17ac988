if __name__ == "__main__":
    from meshlm.cli import main  # here, not above: a rank forked from `python -m meshlm` imports this module

    main()
