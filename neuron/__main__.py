from neuron.cli.main import main

raise SystemExit(main())
