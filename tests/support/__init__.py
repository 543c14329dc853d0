"""What several test modules share: servers and processes to start, reference implementations,
symbolic ranks for the scheduler, torchrun workers.  Imported as ``support.<module>``; the test
folders mirror the packages they test."""
