from neuron.cli import main

raise SystemExit(main())
