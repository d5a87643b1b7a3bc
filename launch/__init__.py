"""Launching: how runs are started and recorded, apart from what the trainer does once started.

python -m launch.torchrun --nproc_per_node=2 train.py ...   # torchrun, a stop exits 0
launch/torchrun.py     torchrun's command lines, the processes it starts, the stop's marks
launch/sweep.py        the sweep's Hydra callbacks (`train.py -m`): stop as a whole, a table
launch/provenance.py   which code and machine measured a number (the scripts' results files)
"""
