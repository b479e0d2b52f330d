//! blk-mq engine (being built; see issue 3).
