"""Sample text from a trained model: `python sample.py run=<a training run's folder> ...`.
The tool is tools/sample.py (the other after-training tools beside it run as
`python -m tools.<tool>`); this entry point keeps the short command."""

from tools.sample import main

if __name__ == "__main__":
    main()
