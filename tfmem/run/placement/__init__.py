"""Where state lives: the device a session runs on and the host.

    accelerator.py        the device a session runs on, an emulated one, the memory budget
    placement_pass.py     the user's state put on the host before placement
"""
