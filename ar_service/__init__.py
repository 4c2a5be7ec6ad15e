"""AR stage of ardit: prompt/grid contract, the MammothModa2-style AR model and its decode loop."""
